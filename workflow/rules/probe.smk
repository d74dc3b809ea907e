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
        gpu=stage_resource("probe", "gpu"),
        mem_mb=stage_resource("probe", "mem_mb"),
        runtime=stage_resource("probe", "runtime"),
    params:
        profile=PROFILE,
        settings=section("probe"),
    script:
        "../scripts/probe.py"
