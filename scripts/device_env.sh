# Sourced at the start of a device-machine command: `source scripts/device_env.sh` (the repo's root).
# Unpacks what the host lacks (.whl/site.tar.xz, from scripts/device_site.sh; the path must name
# site-packages, for dill) and compiles every module's bytecode once. The hosts run with
# PYTHONDONTWRITEBYTECODE=1 and ship no .pyc (not even torch's), so without this every process
# compiles thousands of modules from source: `import torch, peft, trl.trainer.grpo_trainer, datasets`
# took 16-17 s on an H100 host, 11.7 with the archive compiled (2026-12-06), and every job's start in
# a bench paid it where a pip-installed machine does not.
if [ -f .whl/site.tar.xz ]; then
  mkdir -p /tmp/sp/site-packages && tar -xJf .whl/site.tar.xz -C /tmp/sp/site-packages || return 1
  export PYTHONPATH=$PWD:/tmp/sp/site-packages
fi
python3 -m compileall -q -j 0 /tmp/sp/site-packages "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  talkmethods bench > /dev/null 2>&1 || true
export PYTHONUNBUFFERED=1
