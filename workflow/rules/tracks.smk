# Every track reads the probe; the others also the tuning table, the single-GPU ones the
# audit's gates, the FSDP2 track the single-GPU training records (it runs after them).
# `script:` is read after the loop has ended, so its path is formatted from params.
_GATED = {"gates": rules.audit.output.gates, "table": rules.tune.output.table}
_TRAIN_RECORDS = "results/tracks/train/records.jsonl"
_INPUTS = {"ops": {}, "scan": _GATED, "train": _GATED, "infer": _GATED}
_INPUTS["train_fsdp"] = {"table": rules.tune.output.table, "single": _TRAIN_RECORDS}
for _track, _inputs in _INPUTS.items():

    rule:
        name:
            f"track_{_track}"
        input:
            **_inputs,
            environment=rules.probe.output.environment,
        output:
            records=(
                reported("results/tracks/ops/records.jsonl", "ops", "Tracks")
                if _track == "ops"
                else f"results/tracks/{_track}/records.jsonl"
            ),
        log:
            f"results/logs/track_{_track}.log",
        benchmark:
            f"results/benchmarks/track_{_track}.tsv"
        resources:
            **STAGE_RESOURCES["track_fsdp" if _track == "train_fsdp" else "track"],
        params:
            profile=PROFILE,
            section=_track,
            settings=PROFILE_CONFIG[_track.removesuffix("_fsdp")],
            records_dir=f"results/tracks/{_track}/records.d",
        script:
            "../scripts/track_{params.section}.py"
