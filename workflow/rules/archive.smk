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
        "results/logs/archive.log",
    benchmark:
        "results/benchmarks/archive.tsv"
    resources:
        **STAGE_RESOURCES["archive"],
    params:
        profile=PROFILE,
        image=config["container"]["image"],
        runtime=config["container"]["runtime"],
    script:
        "../scripts/archive.py"
