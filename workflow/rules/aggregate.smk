rule aggregate:
    input:
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
        audit=rules.audit.output.summary,
        table=rules.tune.output.table,
        tune_records=rules.tune.output.records,
        records=expand("results/tracks/{track}/records.jsonl", track=TRACKS),
    output:
        report=report(
            "results/report/report.md",
            caption="../report/aggregate.rst",
            category="Report",
        ),
        records_csv=report(
            "results/report/records.csv",
            caption="../report/aggregate.rst",
            category="Tables",
        ),
        comparison_csv=report(
            "results/report/comparison.csv",
            caption="../report/aggregate.rst",
            category="Tables",
        ),
        tables=report(
            "results/report/tables.md",
            caption="../report/aggregate.rst",
            category="Tables",
        ),
        plots=report(
            directory("results/report/plots"),
            patterns=["{name}.png"],
            caption="../report/plots.rst",
            category="Plots",
        ),
    log:
        log_path("aggregate"),
    benchmark:
        benchmark_path("aggregate")
    resources:
        gpu=stage_resource("aggregate", "gpu"),
        mem_mb=stage_resource("aggregate", "mem_mb"),
        runtime=stage_resource("aggregate", "runtime"),
    params:
        profile=PROFILE,
    script:
        "../scripts/aggregate.py"
