import sys

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log

to_rule_log(snakemake.log[0])

from talkmethods.errors import friendly_errors
from talkmethods.split import split_stage

with friendly_errors():
    split_stage(dict(snakemake.params.split), snakemake.output.train, snakemake.output.heldout, snakemake.output.stats)
