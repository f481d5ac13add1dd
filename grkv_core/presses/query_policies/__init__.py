"""GRKV's surrogate-query policies: which queries stand in for the unknown future queries (paper Sec. 3.2).

- ``base``: ``QueryPolicy``, what a policy states (its prompt rows, rotations, causality, loss weight), and
  ``QueryRows``.
- one policy per file, each registered by name in ``grkv_core.catalog.QUERY_POLICIES``: ``window`` (the paper),
  ``stratified`` (the authors' code), ``mixture`` (half of each), ``expected`` (draws at future positions).
- ``surrogates``: ``surrogate_queries``, one layer's queries under any policy, and ``PolicyRowsMemo``, the rows a
  prefill's layers share.
"""

from grkv_core.presses.query_policies.base import QueryPolicy, QueryRows
from grkv_core.presses.query_policies.expected import ExpectedQueries
from grkv_core.presses.query_policies.mixture import MixtureQueries
from grkv_core.presses.query_policies.stratified import StratifiedQueries
from grkv_core.presses.query_policies.surrogates import (
    PolicyRowsMemo,
    SurrogateQueries,
    query_policy,
    surrogate_queries,
)
from grkv_core.presses.query_policies.window import WindowQueries

__all__ = [
    "ExpectedQueries",
    "MixtureQueries",
    "PolicyRowsMemo",
    "QueryPolicy",
    "QueryRows",
    "StratifiedQueries",
    "SurrogateQueries",
    "WindowQueries",
    "query_policy",
    "surrogate_queries",
]
