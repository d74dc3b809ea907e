rule tune:
    input:
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
    output:
        table=reported("results/tune/tuning.json", "tune", "Tuning"),
        records="results/tune/records.jsonl",
    log:
        log_path("tune"),
    benchmark:
        benchmark_path("tune")
    resources:
        **stage_resources("tune"),
    params:
        profile=PROFILE,
        settings=PROFILE_CONFIG["tune"],
        records_dir="results/tune/records.d",
    script:
        "../scripts/tune.py"
