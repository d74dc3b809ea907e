# Every track reads the probe; all but the ops track also the audit and the tuning table.
# `script:` is read after the loop has ended, so its path is formatted from params.
_GATED = {"gates": rules.audit.output.gates, "table": rules.tune.output.table}
for _track in ("ops", "scan", "train", "infer"):

    rule:
        name:
            f"track_{_track}"
        input:
            **({} if _track == "ops" else _GATED),
            environment=rules.probe.output.environment,
        output:
            records=(
                reported("results/tracks/ops/records.jsonl", "ops", "Tracks")
                if _track == "ops"
                else f"results/tracks/{_track}/records.jsonl"
            ),
        log:
            log_path(f"track_{_track}"),
        benchmark:
            benchmark_path(f"track_{_track}")
        resources:
            **stage_resources("track"),
        params:
            profile=PROFILE,
            section=_track,
            settings=PROFILE_CONFIG[_track],
            records_dir=f"results/tracks/{_track}/records.d",
        script:
            "../scripts/track_{params.section}.py"


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
        **stage_resources("track_fsdp"),
    params:
        profile=PROFILE,
        section="train",
        settings=PROFILE_CONFIG["train"],
        records_dir="results/tracks/train_fsdp/records.d",
    script:
        "../scripts/track_train_fsdp.py"
