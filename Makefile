# The README's two commands: `make run` (the notebook series, headless) and `make test` (the test suite).
PY := .venv/bin/python

.PHONY: run test venv clean

venv:
	bash scripts/bootstrap.sh

run: venv
	$(PY) -m ctxpatch_lite.run_notebooks $(ARGS)

# Stored notebook outputs were produced with one torch thread; tests pin the same for deterministic outputs.
test: venv
	bash scripts/install_browser.sh
	CTXPATCH_THREADS=1 $(PY) -m pytest tests notebooks --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg --nbval-kernel-name python3 -p no:cacheprovider $(ARGS)

clean:
	rm -rf runs .pytest_cache
