rule archive:
    input:
        rules.aggregate.output,
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
        table=rules.tune.output.table,
        records=expand("results/tracks/{track}/records.jsonl", track=TRACKS),
    output:
        artifact=ARTIFACT,
    log:
        log_path("archive"),
    benchmark:
        benchmark_path("archive")
    resources:
        gpu=stage_resource("archive", "gpu"),
        mem_mb=stage_resource("archive", "mem_mb"),
        runtime=stage_resource("archive", "runtime"),
    params:
        profile=PROFILE,
        image=config["container"]["image"],
        runtime=config["container"]["runtime"],
    script:
        "../scripts/archive.py"
