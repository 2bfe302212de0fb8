import sys

sys.path.insert(0, snakemake.scriptdir)
from _log import to_rule_log

to_rule_log(snakemake.log[0])

import json
from pathlib import Path

from talkmethods.card import write_card

summary = json.loads(Path(snakemake.input.summary).read_text())
meta = dict(snakemake.params.meta)
meta["device"] = ", ".join(summary.get("compute", {}).get("devices", [])) or "unknown"
write_card(summary, Path(snakemake.output.md).parent, snakemake.output.md, snakemake.output.png, meta)
