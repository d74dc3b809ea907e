"""Track stage (placeholder until the measurement stages land): measures nothing
and concatenates whatever records its records.d holds for this profile."""

from common import records, stage


def main(job):
    recs = records.collect(job.params["records_dir"], job.output.records, profile=job.profile)
    print(f"{job.rule}: {len(recs)} records")


if __name__ == "__main__":
    stage.run(main, globals().get("snakemake"))
