rule probe:
    output:
        environment=report(
            "results/probe/environment.json",
            caption="../report/probe.rst",
            category="Environment",
        ),
    log:
        log_path("probe"),
    benchmark:
        benchmark_path("probe")
    resources:
        **stage_resources("probe"),
    params:
        profile=PROFILE,
        settings=section("probe"),
    script:
        "../scripts/probe.py"
