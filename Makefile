# The README's two commands: `make run` (the notebook series, headless) and `make test` (the test suite).
PY := .venv/bin/python

.PHONY: run test venv clean

venv:
	bash scripts/bootstrap.sh

run: venv
	$(PY) -m ctxpatch_lite.run_notebooks $(ARGS)

# Stored notebook outputs were produced with one torch thread; tests pin the same for deterministic outputs.
# nbval compares the words of the stored outputs (numbers masked, notebooks/nbval_sanitize.cfg); the notebooks'
# metrics are compared with notebooks/expected_metrics.json, each under its rule (ctxpatch_lite.arithmetic).
PYTEST := CTXPATCH_THREADS=1 $(PY) -m pytest -p no:cacheprovider
NBVAL := --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg --nbval-kernel-name python3
# The second arithmetic path (ctxpatch_lite.arithmetic.SECOND_PATH): the notebooks and the reference check once more,
# with every library on another vector width, against the same stored outputs.
SECOND_PATH = $(shell $(PY) -c "from ctxpatch_lite.arithmetic import SECOND_PATH as P; print(' '.join(f'{k}={v}' for k, v in P.items()))")

test: venv
	bash scripts/install_browser.sh
	$(PYTEST) tests notebooks $(NBVAL) $(ARGS)
	@echo "[make test] the notebooks and the reference check on the second arithmetic path: $(SECOND_PATH)"
	env $(SECOND_PATH) $(PYTEST) notebooks tests/test_claims.py::test_reference_data_is_what_todays_code_produces $(NBVAL) $(ARGS)

clean:
	rm -rf runs .pytest_cache
