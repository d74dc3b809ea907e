rule track_scan:
    input:
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
        table=rules.tune.output.table,
    output:
        records="results/tracks/scan/records.jsonl",
    log:
        log_path("track_scan"),
    benchmark:
        benchmark_path("track_scan")
    resources:
        gpu=stage_resource("track", "gpu"),
        mem_mb=stage_resource("track", "mem_mb"),
        runtime=stage_resource("track", "runtime"),
    params:
        profile=PROFILE,
        section="scan",
        settings=section("scan"),
        records_dir="results/tracks/scan/records.d",
    script:
        "../scripts/track_scan.py"


rule track_train:
    input:
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
        table=rules.tune.output.table,
    output:
        records="results/tracks/train/records.jsonl",
    log:
        log_path("track_train"),
    benchmark:
        benchmark_path("track_train")
    resources:
        gpu=stage_resource("track", "gpu"),
        mem_mb=stage_resource("track", "mem_mb"),
        runtime=stage_resource("track", "runtime"),
    params:
        profile=PROFILE,
        section="train",
        settings=section("train"),
        records_dir="results/tracks/train/records.d",
    script:
        "../scripts/track_train.py"


rule track_train_fsdp:
    input:
        environment=rules.probe.output.environment,
        table=rules.tune.output.table,
        single=rules.track_train.output.records,
    output:
        records="results/tracks/train_fsdp/records.jsonl",
    log:
        log_path("track_train_fsdp"),
    benchmark:
        benchmark_path("track_train_fsdp")
    resources:
        gpu=stage_resource("track_fsdp", "gpu"),
        mem_mb=stage_resource("track_fsdp", "mem_mb"),
        runtime=stage_resource("track_fsdp", "runtime"),
    params:
        profile=PROFILE,
        section="train",
        settings=section("train"),
        records_dir="results/tracks/train_fsdp/records.d",
    script:
        "../scripts/track_train_fsdp.py"


rule track_infer:
    input:
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
        table=rules.tune.output.table,
    output:
        records="results/tracks/infer/records.jsonl",
    log:
        log_path("track_infer"),
    benchmark:
        benchmark_path("track_infer")
    resources:
        gpu=stage_resource("track", "gpu"),
        mem_mb=stage_resource("track", "mem_mb"),
        runtime=stage_resource("track", "runtime"),
    params:
        profile=PROFILE,
        section="infer",
        settings=section("infer"),
        records_dir="results/tracks/infer/records.d",
    script:
        "../scripts/track_infer.py"


rule track_ops:
    input:
        environment=rules.probe.output.environment,
    output:
        records=report(
            "results/tracks/ops/records.jsonl",
            caption="../report/ops.rst",
            category="Tracks",
        ),
    log:
        log_path("track_ops"),
    benchmark:
        benchmark_path("track_ops")
    resources:
        gpu=stage_resource("track", "gpu"),
        mem_mb=stage_resource("track", "mem_mb"),
        runtime=stage_resource("track", "runtime"),
    params:
        profile=PROFILE,
        section="ops",
        settings=section("ops"),
        records_dir="results/tracks/ops/records.d",
    script:
        "../scripts/track_ops.py"
