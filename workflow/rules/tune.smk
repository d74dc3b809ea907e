rule tune:
    input:
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
    output:
        table=reported("results/tune/tuning.json", "tune", "Tuning"),
        records="results/tune/records.jsonl",
    log:
        "results/logs/tune.log",
    benchmark:
        "results/benchmarks/tune.tsv"
    resources:
        **STAGE_RESOURCES["tune"],
    params:
        profile=PROFILE,
        settings=PROFILE_CONFIG["tune"],
        records_dir="results/tune/records.d",
    script:
        "../scripts/tune.py"
