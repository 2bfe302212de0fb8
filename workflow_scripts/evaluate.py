import sys

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log, use_threads

to_rule_log(snakemake.log[0])
use_threads(snakemake.threads)

from talkmethods.errors import friendly_errors
from talkmethods.evaluate import eval_stage
from talkmethods.gpu import claim_gpu

w = snakemake.wildcards
kind = w.get("kind", "base")
with friendly_errors(), claim_gpu():
    eval_stage(
        dict(snakemake.params.eval),
        kind,
        snakemake.input.problems,
        snakemake.input.get("adapter"),
        snakemake.output[0],
        arm=w.get("arm"),
        seed=int(w["seed"]) if "seed" in w.keys() else None,
    )
