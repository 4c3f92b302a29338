# The two commands a newcomer needs: `make run` and `make test`. Both set up first.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup run smoke test test-deploy check-patches bench clean

setup:
	@bash scripts/setup.sh

run: setup
	$(PY) -m sglang_disagg.launch --role all

smoke: setup
	$(PY) -m sglang_disagg.launch --role all --smoke

check-patches: setup
	$(PY) -m sglang_disagg.patchtool check
	$(PY) -m sglang_disagg.patchtool export --check

test: setup check-patches
	$(PY) -m pytest tests --durations=25 $(PYTEST_ARGS)

# Deployments on their engines (root, Debian's Slurm and munge, minutes): not part of `make test`.
test-deploy: setup
	@bash scripts/deploy-setup.sh
	CI=true SGLANG_DISAGG_DEPLOY_TESTS=1 $(PY) -m pytest tests/deploy -s --durations=0 $(PYTEST_ARGS)

bench: setup
	$(PY) benchmarks/transfer.py --out results/transfer

clean:
	rm -rf .venv build *.egg-info results
