"""ApplyDeclarationsOperator: the ``airflow-broker apply`` YAML file as an Airflow task.

The file format is described in ``docs/declarations.md``. Applying is all or nothing: the file
is checked as a whole against the database (every problem listed, nothing written when there is
one), then every change runs in one transaction. Applying the same file again changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_broker.errors import InvalidDefinition
from airflow_broker.operations import declarations
from airflow_broker.operators.dialog import BrokerOperator

if TYPE_CHECKING:
    from airflow_broker.broker import Broker
    from airflow_broker.provider.compat import Context


class ApplyDeclarationsOperator(BrokerOperator):
    """Declare broker objects (message types, contracts, queues, services, routes, priorities,
    broker settings) from the declarations YAML, idempotently.

    Returns (XCom) the plan's lines, as ``airflow-broker apply`` prints them:
    ``+ queue q: created``, ``~ queue q: altered (...)``, ``= broker setting ...``; objects that
    are already as declared are not listed.

    :param path: the YAML file (templated); a relative path is relative to the DAG file's
        folder.
    :param text: the YAML itself (templated), instead of ``path``.
    :param dry_run: only plan: return what would change and write nothing (kept as
        ``plan_only``: ``BaseOperator.dry_run`` is a method).
    """

    template_fields: Sequence[str] = ("path", "text")
    template_fields_renderers = {"text": "yaml"}
    ui_color = "#f5f0e1"

    def __init__(
        self,
        *,
        path: str | None = None,
        text: str | None = None,
        dry_run: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if (path is None) == (text is None):
            raise ValueError(
                f"{type(self).__name__} {kwargs.get('task_id')!r}: give the declarations as "
                "path= (a YAML file) or text= (the YAML itself), exactly one of them"
            )
        self.path = path
        self.text = text
        self.plan_only = dry_run

    def describe(self) -> str:
        return f"apply declarations {self._source_name()}"

    def _source_name(self) -> str:
        return str(self.path) if self.path is not None else "<text>"

    def _read(self) -> tuple[str, str]:
        if self.text is not None:
            return self.text, "<text>"
        path = Path(str(self.path)).expanduser()
        if not path.is_absolute() and self.has_dag():
            path = Path(self.dag.folder) / path
        try:
            return path.read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidDefinition(f"cannot read declarations file {path}: {exc}") from exc

    def execute(self, context: Context) -> list[str]:
        def apply(broker: Broker) -> tuple[declarations.Plan, str]:
            from airflow_broker.cli import broker_settings

            source, filename = self._read()
            decls, problems = declarations.parse(source)
            the_plan, plan_problems = declarations.plan(
                decls,
                broker.catalog(),
                settings=broker_settings(broker),
                granted=declarations.granted_now(broker) if decls.permissions else (),
            )
            problems = problems + plan_problems
            if problems:
                error = declarations.DeclarationsInvalid(filename, problems)
                for line in error.lines():
                    self.log.error("%s", line)
                    error.add_note(line)
                raise error
            if the_plan.has_changes and not self.plan_only:
                with broker.definitions() as d:
                    declarations.apply_plan(the_plan, d)
            return the_plan, filename

        the_plan, filename = self.run(apply)
        lines = plan_lines(the_plan)
        for line in lines:
            self.log.info("%s", line)
        if not the_plan.has_changes:
            self.log.info("%s: nothing to change, the database already matches", filename)
        elif self.plan_only:
            self.log.info("%s: dry run, nothing was written", filename)
        return lines


def plan_lines(the_plan: declarations.Plan) -> list[str]:
    """The lines ``airflow-broker apply`` prints for a plan: every change, every setting, every
    permission entry."""
    lines = [c.describe() for c in the_plan.changes if c.action != "unchanged"]
    lines.extend(s.describe() for s in the_plan.settings)
    lines.extend(p.describe() for p in the_plan.permissions)
    return lines


__all__ = ["ApplyDeclarationsOperator", "plan_lines"]
