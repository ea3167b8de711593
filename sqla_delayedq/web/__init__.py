"""A web dashboard for operators (optional extra: ``pip install 'sqla_delayedq[web]'``).

Mount it in your Starlette or FastAPI application::

    from starlette.routing import Mount
    from sqla_delayedq.web import dashboard

    app.routes.append(Mount("/admin/queues", app=dashboard(worker, authorize=is_admin)))

or serve it on its own with ``delayedq web``. See ``docs/dashboard.md``.
"""

from __future__ import annotations

from ._app import Dashboard, dashboard

__all__ = ["Dashboard", "dashboard"]
