import sys

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log

to_rule_log(snakemake.log[0])

from pathlib import Path

from talkmethods.aggregate import summarize, write_summary

p = snakemake.params
results_dir = Path(snakemake.output.csv).parent
summary = summarize(results_dir, list(p.arms), list(p.seeds), n_boot=p.n_boot, alpha=p.alpha)
write_summary(summary, snakemake.output.csv, snakemake.output.json)
