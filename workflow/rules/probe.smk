rule probe:
    output:
        environment=reported("results/probe/environment.json", "probe", "Environment"),
    log:
        "results/logs/probe.log",
    benchmark:
        "results/benchmarks/probe.tsv"
    resources:
        **STAGE_RESOURCES["probe"],
    params:
        profile=PROFILE,
        settings=PROFILE_CONFIG["probe"],
    script:
        "../scripts/probe.py"
