import sys

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log, use_threads

to_rule_log(snakemake.log[0])
use_threads(snakemake.threads)

from talkmethods.errors import friendly_errors
from talkmethods.gpu import claim_gpu
from talkmethods.warmstart import warmstart_stage

with friendly_errors(), claim_gpu():
    warmstart_stage(
        dict(snakemake.params.warmstart),
        snakemake.input.problems,
        snakemake.output.model,
        snakemake.output.stats,
    )
