rule tune:
    input:
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
    output:
        table="results/tune/tuning.json",
    log:
        log_path("tune"),
    benchmark:
        benchmark_path("tune")
    params:
        profile=PROFILE,
        section="tune",
        settings=section("tune"),
    script:
        "../scripts/tune.py"
