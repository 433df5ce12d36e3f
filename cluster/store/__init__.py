"""The AdapterStore, split by job.

deployment.py  AdapterStore: the Serve deployment, its public async methods
registry.py    names -> versions: register, unregister, resolve, weights, listing
paths.py       where adapters may be read from (adapter roots, a tenant's own)
conversion.py  a PEFT directory checked, converted once, put in the object store
adapter_tokens.py  the tokens an adapter adds to the vocabulary (refused)
checkpoint.py  the registry's copy in a named detached actor: a restart lists it at once
reports.py     replica reports, answered with the versions to drop
locks.py       one lock per adapter name

What crosses to the ingress and the replicas (AdapterInfo, AdapterWeightsRef, Listing,
ReportReply) is in replica/wire.py.
"""

from cluster.store.deployment import AdapterStore

__all__ = ["AdapterStore"]
