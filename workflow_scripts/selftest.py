import sys

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log

to_rule_log(snakemake.log[0])

from talkmethods.atomic import write_json
from talkmethods.selftest import run_selftest

report = run_selftest()
write_json(snakemake.output[0], report)
if not report["passed"]:
    failed = ", ".join(c["name"] for c in report["checks"] if not c["passed"])
    sys.exit(f"selftest FAILED: {failed} (see {snakemake.log[0]})")
