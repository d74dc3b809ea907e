rule audit:
    input:
        environment=rules.probe.output.environment,
    output:
        gates=report(
            "results/audit/gates.json",
            caption="../report/audit.rst",
            category="Correctness audit",
        ),
        summary=report(
            "results/audit/audit.md",
            caption="../report/audit.rst",
            category="Correctness audit",
        ),
    log:
        log_path("audit"),
    benchmark:
        benchmark_path("audit")
    resources:
        gpu=stage_resource("audit", "gpu"),
        mem_mb=stage_resource("audit", "mem_mb"),
        runtime=stage_resource("audit", "runtime"),
    params:
        profile=PROFILE,
        settings=section("audit"),
    script:
        "../scripts/audit.py"
