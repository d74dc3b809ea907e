# The study pipeline: probe -> audit -> tune -> tracks -> aggregate -> archive.
# Run `snakemake --cores 1 all`; see README.md.


include: "workflow/rules/common.smk"


container: CONTAINER


report: "workflow/report/workflow.rst"


include: "workflow/rules/probe.smk"
include: "workflow/rules/audit.smk"
include: "workflow/rules/tune.smk"
include: "workflow/rules/tracks.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/archive.smk"


rule all:
    default_target: True
    input:
        ARTIFACT,
