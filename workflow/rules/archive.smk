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
    params:
        profile=PROFILE,
        image=config["container"]["image"],
        runtime=config["container"]["runtime"],
    script:
        "../scripts/archive.py"
