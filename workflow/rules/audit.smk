rule audit:
    input:
        environment=rules.probe.output.environment,
    output:
        gates=reported("results/audit/gates.json", "audit", "Correctness audit"),
        summary=reported("results/audit/audit.md", "audit", "Correctness audit"),
    log:
        "results/logs/audit.log",
    benchmark:
        "results/benchmarks/audit.tsv"
    resources:
        **STAGE_RESOURCES["audit"],
    params:
        profile=PROFILE,
        settings=PROFILE_CONFIG["audit"],
        # the decode step options the tune stage may choose, gated here first
        step_grids=PROFILE_CONFIG["tune"].get("decode", {}).get("options", {}),
    script:
        "../scripts/audit.py"
