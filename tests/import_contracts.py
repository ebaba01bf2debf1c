"""import-linter contract type for what the built-in ones cannot say: no import of named submodules of external packages.

import-linter sees an external package as one module (``torch``), so its ``forbidden`` contract
cannot tell ``torch.distributed`` from ``torch``. This contract reads the import statements
themselves: ``import torch.distributed``, ``from torch import distributed`` and
``from megatron.core.models.gpt import GPTModel`` name ``torch.distributed`` and
``megatron.core.models.gpt.GPTModel`` in full. ``.importlinter`` registers it as
``forbidden_external_submodules``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Dict, List

from importlinter.application import contract_utils, output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def imported_names(source: str) -> Dict[int, List[str]]:
    """{line: the dotted names the absolute import statement starting on that line brings in} of Python ``source``."""
    names: Dict[int, List[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.setdefault(node.lineno, []).extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.setdefault(node.lineno, []).extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def module_file(module: str) -> Path:
    """The source file of ``module`` (found beside its root package's ``__init__.py``, nothing imported)."""
    root, *parts = module.split(".")
    package = Path(importlib.util.find_spec(root).origin).parent
    candidate = package.joinpath(*parts)
    return candidate.with_suffix(".py") if candidate.with_suffix(".py").is_file() else candidate / "__init__.py"


class ForbiddenExternalSubmodules(Contract):
    """``source_modules`` and their descendants import none of ``forbidden_modules`` (dotted names of
    external packages or of their submodules, e.g. ``torch.distributed``), at any depth of a function."""

    type_name = "forbidden_external_submodules"

    source_modules = fields.ListField(subfield=fields.ModuleField())
    forbidden_modules = fields.ListField(subfield=fields.StringField())
    broken_contract_guidance = fields.TextField(required=False)

    def check(self, graph, verbose: bool) -> ContractCheck:
        forbidden = list(self.forbidden_modules)  # type: ignore[arg-type]
        roots = {name.split(".")[0] for name in forbidden}
        violations = []
        for source in self.source_modules:  # type: ignore[attr-defined]
            for importer in sorted({source.name} | graph.find_descendants(source.name)):
                statements = None
                for imported in sorted(graph.find_modules_directly_imported_by(importer) & roots):
                    statements = statements or imported_names(module_file(importer).read_text())
                    for detail in graph.get_import_details(importer=importer, imported=imported):
                        for name in statements.get(detail["line_number"], []):
                            hit = next((f for f in forbidden if name == f or name.startswith(f + ".")), None)
                            if hit is not None:
                                violations.append(
                                    {
                                        "importer": importer,
                                        "forbidden": hit,
                                        "line_number": detail["line_number"],
                                        "line_contents": detail["line_contents"],
                                    }
                                )
        return ContractCheck(kept=not violations, metadata={"violations": violations})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for violation in check.metadata["violations"]:
            output.print_error(f"{violation['importer']} is not allowed to import {violation['forbidden']}:")
            output.print_error(
                f"-   {violation['importer']} (l.{violation['line_number']}): {violation['line_contents']}", bold=False
            )
            output.new_line()
        contract_utils.render_broken_contract_guidance(self.broken_contract_guidance)  # type: ignore[arg-type]
