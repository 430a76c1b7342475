"""The package's public surface."""

from __future__ import annotations

import stages.model as forward


class TestExports:
    def test_all_names_exist_once(self) -> None:
        """Every name in __all__ exists and is listed exactly once."""
        assert len(forward.__all__) == len(set(forward.__all__))
        for name in forward.__all__:
            assert hasattr(forward, name), name

    def test_public_names_are_exported(self) -> None:
        """Every public attribute that is not a submodule is in __all__."""
        import types

        public = {
            n
            for n, v in vars(forward).items()
            if not n.startswith("_") and not isinstance(v, types.ModuleType)
        }
        assert public == set(forward.__all__)
