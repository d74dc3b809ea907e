rule probe:
    output:
        environment=reported("results/probe/environment.json", "probe", "Environment"),
    log:
        log_path("probe"),
    benchmark:
        benchmark_path("probe")
    resources:
        **stage_resources("probe"),
    params:
        profile=PROFILE,
        settings=PROFILE_CONFIG["probe"],
    script:
        "../scripts/probe.py"
