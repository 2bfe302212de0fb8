import sys
from pathlib import Path

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log, use_threads

to_rule_log(snakemake.log[0])
use_threads(snakemake.threads)

from talkmethods.errors import friendly_errors
from talkmethods.evaluate import eval_stages
from talkmethods.gpu import claim_gpu

w = snakemake.wildcards
# one kind (the {kind} wildcard; none and no arm: the base eval), or a run's kinds in one job
# (eval.one_job_per_run), read from its outputs' names so that its params stay eval_run's
if "kind" in w.keys():
    kinds = [w.kind]
else:
    kinds = [Path(out).stem for out in snakemake.output] if "arm" in w.keys() else ["base"]
with friendly_errors(), claim_gpu():
    eval_stages(
        dict(snakemake.params.eval),
        kinds,
        snakemake.input.problems,
        snakemake.input.get("adapter"),
        list(snakemake.output),
        arm=w.get("arm"),
        seed=int(w["seed"]) if "seed" in w.keys() else None,
    )
