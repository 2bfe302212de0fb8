import sys

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log, use_threads

to_rule_log(snakemake.log[0])
use_threads(snakemake.threads)

from talkmethods.errors import friendly_errors
from talkmethods.gpu import claim_gpu
from talkmethods.training.cohort import train_cohort_stage

with friendly_errors(), claim_gpu():
    train_cohort_stage(
        [dict(p) for p in snakemake.params.train],
        snakemake.input.problems,
        list(snakemake.output.adapters),
        list(snakemake.output.logs),
        list(snakemake.params.work_dirs),
    )
