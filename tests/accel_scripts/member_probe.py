"""Which public members of accelerate.Accelerator hyperacc.Accelerator lacks, and whether each name on
hyperacc.accelerator.NOT_SUPPORTED raises a NotImplementedError that names it. One process, no
launcher; prints one `METRIC {json}` line."""
import json

import accelerate

import hyperacc
import hyperacc.accelerator as hyperacc_accelerator

public = sorted(n for n in dir(accelerate.Accelerator) if not n.startswith("_"))
missing = [n for n in public if not hasattr(hyperacc.Accelerator, n)]
not_supported = getattr(hyperacc_accelerator, "NOT_SUPPORTED", None)

bad = {}
if not_supported is not None:
    acc = hyperacc.Accelerator()
    for name in not_supported:
        try:
            member = getattr(acc, name)
            if callable(member):
                member()
            bad[name] = "no NotImplementedError (accessed" + (" and called)" if callable(member) else ")")
        except NotImplementedError as error:
            if name not in str(error):
                bad[name] = f"NotImplementedError does not name it: {error}"
        except Exception as error:  # noqa: BLE001 - any other error is a finding
            bad[name] = f"{type(error).__name__}: {error}"

print("METRIC " + json.dumps({
    "kind": "members", "public": public, "missing": missing,
    "not_supported": None if not_supported is None else list(not_supported),
    "not_supported_problems": bad,
}), flush=True)
