import importlib.util
import os
import sys

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log

to_rule_log(snakemake.log[0])

from talkmethods.errors import friendly_errors
from talkmethods.gpu import claim_gpu

spec = importlib.util.spec_from_file_location("speed", snakemake.input.script)
speed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(speed)
argv = ["--model", snakemake.params.model, "--out", os.path.dirname(snakemake.output.json)]
with friendly_errors(), claim_gpu():  # the GPU to itself: a shared one would measure the other job too
    speed.main(argv + (["--quick"] if snakemake.params.quick else []))
