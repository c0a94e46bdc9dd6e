"""compress-and-heal: the whole pipeline, one cached task per stage.

Every stage is keyed on the digest of its inputs and settings: a run that
failed, run again, finds every finished stage in the cache and resumes at the
one that failed. One MLflow run per flow run, tagged with the Prefect flow-run
id and the parameter set's name.
"""

from __future__ import annotations

from prefect import flow

from cortiq.chains import compress_and_heal as chain
from cortiq.settings import load_settings

from .flow_run import finish, run_tracked
from .summary import log_gap


@flow(name="compress-and-heal", log_prints=True)
def compress_and_heal(params: str | dict = "deployments/params/demo.yaml") -> dict:
    """Run the pipeline on a parameter set (a YAML file or its mapping); returns the summary."""
    s = load_settings(params)
    with run_tracked(s, "compress-and-heal") as st:
        final, m = chain(st, s)  # its table of contents: cortiq.chains.compress_and_heal
        st.texts = m.texts
        log_gap(st)
        # the final model logged and registered (`champion` moves only on a better test NLL)
        return finish(st, "healed", final)
