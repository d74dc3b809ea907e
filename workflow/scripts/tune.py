"""Kernel tuning stage (placeholder until the measurement stages land): writes an
empty tuning table, so `backend="auto"` keeps its fixed default."""

from common import atomic, facts, stage


def main(job):
    atomic.write_json(
        job.output.table, {"schema": 1, "profile": job.profile, "gpu": facts.gpu(), "entries": []}
    )


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
