"""The compiled extension is imported only after torch (it links against libc10 / libtorch, which the
dynamic loader finds only once torch has loaded them): on the H200, `extension_status()` called first in a
fresh interpreter reported 'libc10.so: cannot open shared object file' and kept the extension off."""

import subprocess
import sys
import textwrap


def test_torch_is_imported_before_the_extension():
    code = textwrap.dedent("""
        import importlib.abc, sys
        seen = []
        class Probe(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "nvfp4_plugin._C":
                    seen.append("torch" in sys.modules)
                    raise ImportError("probe: no extension here")
                return None
        sys.meta_path.insert(0, Probe())
        from nvfp4_plugin._ext import extension_status
        st = extension_status()
        assert seen == [True], seen
        assert not st.loaded and "probe" in st.error, st
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
