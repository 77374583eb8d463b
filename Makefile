# The two commands a newcomer needs: `make run` and `make test`.
# Both set everything up on first use (scripts/setup.sh).
PYTEST_ARGS ?=

.PHONY: run test setup freeze clean

run: setup
	.venv/bin/python examples/offline_demo.py

test:
	bash scripts/run_tests.sh $(PYTEST_ARGS)

setup:
	bash scripts/setup.sh

# Re-pin every package after a deliberate upgrade.
freeze:
	( echo '# Every package of the environment, pinned. Regenerate with `make freeze`.'; \
	  .venv/bin/pip freeze --all | grep -v -e '^vllm' -e '^pip=' -e 'vllm.spyre.intree' | sed 's/+cpu//' | sort ) > constraints.txt

clean:
	rm -rf build dist *.egg-info .pytest_cache
