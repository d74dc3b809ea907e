rule aggregate:
    input:
        environment=rules.probe.output.environment,
        gates=rules.audit.output.gates,
        audit=rules.audit.output.summary,
        table=rules.tune.output.table,
        tune_records=rules.tune.output.records,
        records=expand("results/tracks/{track}/records.jsonl", track=TRACKS),
    output:
        report=reported("results/report/report.md", "aggregate", "Report"),
        records_csv=reported("results/report/records.csv", "aggregate", "Tables"),
        comparison_csv=reported("results/report/comparison.csv", "aggregate", "Tables"),
        baseline_csv=reported("results/report/baseline.csv", "aggregate", "Tables"),
        tables=reported("results/report/tables.md", "aggregate", "Tables"),
        plots=reported(
            directory("results/report/plots"),
            "plots",
            "Plots",
            patterns=["{name}.png"],
        ),
    log:
        "results/logs/aggregate.log",
    benchmark:
        "results/benchmarks/aggregate.tsv"
    resources:
        **STAGE_RESOURCES["aggregate"],
    params:
        profile=PROFILE,
        baseline=config.get("baseline"),
    script:
        "../scripts/aggregate.py"
