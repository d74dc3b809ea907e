rule tune:
    input:
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
    output:
        table=report(
            "results/tune/tuning.json",
            caption="../report/tune.rst",
            category="Tuning",
        ),
        records="results/tune/records.jsonl",
    log:
        log_path("tune"),
    benchmark:
        benchmark_path("tune")
    resources:
        gpu=stage_resource("tune", "gpu"),
        mem_mb=stage_resource("tune", "mem_mb"),
        runtime=stage_resource("tune", "runtime"),
    params:
        profile=PROFILE,
        section="tune",
        settings=section("tune"),
        records_dir="results/tune/records.d",
    script:
        "../scripts/tune.py"
