"""What the tests that run jedi in this process share
(tests/unit/test_api_names.py, tests/unit/test_gradient_walk.py): an
interpreter environment with a parse cache of the process's own (two test
workers writing the shared ~/.cache/jedi at once can leave each other a
torn file), and a module fixture that takes the rank site's import finders
off sys.meta_path, through which jedi resolves nothing."""

import atexit
import shutil
import tempfile

import jedi
import pytest

from tests.support.helpers import without_rank_site_finders

ENVIRONMENT = jedi.InterpreterEnvironment()
jedi.settings.cache_directory = tempfile.mkdtemp(prefix="kerasdist-jedi-")
atexit.register(shutil.rmtree, jedi.settings.cache_directory, True)


@pytest.fixture(autouse=True, scope="module")
def static_analysis_sees_every_module():
    """Imported by a test module, used by each of its tests."""
    with without_rank_site_finders():
        yield
