import sys

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log

to_rule_log(snakemake.log[0])

from talkmethods.card import write_train_curve

w = snakemake.wildcards
write_train_curve(snakemake.input.log, snakemake.output[0], f"{w.arm}, seed {w.seed}")
