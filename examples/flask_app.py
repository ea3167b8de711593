"""Flask with Flask-SQLAlchemy: offer in ``db.session``; a worker as a Flask CLI command.

Signing up writes the user and offers the welcome message in one transaction: a request that
fails (here: an address outside example.com) leaves neither behind, because Flask-SQLAlchemy
rolls back the session at the end of every request that did not commit.

    pip install 'sqla_delayedq[examples]'
    export DATABASE_URL=sqlite:///flask-demo.sqlite
    flask --app examples.flask_app run                # the web process
    flask --app examples.flask_app delayedq-worker    # the worker process (SIGTERM stops it)
    curl -X POST localhost:5000/signup -H 'content-type: application/json' \\
         -d '{"email": "ada@example.com"}'

``create_app`` creates the tables for the demo; an application migrates with Alembic (or
Flask-Migrate, which autogenerates the queue table from the mixin like any other model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from flask import Flask, abort, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from sqla_delayedq import (
    DataclassSerializer,
    DelayedQueue,
    Envelope,
    QueueMessageMixin,
    configure_sqlite,
)
from sqla_delayedq.worker import Worker


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)


class User(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "flask_users"

    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(String(200), unique=True)
    welcomed: Mapped[bool] = mapped_column(default=False)


class Message(QueueMessageMixin, db.Model):  # type: ignore[name-defined,misc]
    """The queue's table, on the application's own models."""

    __tablename__ = "flask_messages"


@dataclass(frozen=True)
class Welcome:
    user_id: int


welcomes = DelayedQueue("welcome", model=Message, serializer=DataclassSerializer(Welcome))


def send_welcome(envelope: Envelope[Welcome], session: Session) -> None:
    """Transactional mode: the flag commits together with the message's removal."""
    user = session.get(User, envelope.payload.user_id)
    if user is not None:
        user.welcomed = True  # an application would send the e-mail here


def create_app(database_url: str | None = None) -> Flask:
    app = Flask(__name__)
    url = database_url or os.environ.get("DATABASE_URL", "sqlite:///flask-demo.sqlite")
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    if url.startswith(("mysql", "mariadb")):
        # What sqla_delayedq.create_engine sets: no gap locks between producers and consumers.
        app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"isolation_level": "READ COMMITTED"}
    db.init_app(app)
    with app.app_context():
        configure_sqlite(db.engine)  # WAL and BEGIN IMMEDIATE; nothing on other backends
        db.create_all()  # the demo's schema

    @app.post("/signup")
    def signup() -> Any:
        email = (request.get_json() or {}).get("email", "")
        user = User(email=email)
        db.session.add(user)
        db.session.flush()  # the user's id, for the message key
        # db.session() is the request's Session behind Flask-SQLAlchemy's scoped proxy.
        welcomes.offer(db.session(), f"welcome/{user.id}", Welcome(user.id))
        if not email.endswith("@example.com"):
            abort(400, "only example.com addresses")  # rolls back the user and the message
        db.session.commit()
        return {"id": user.id}, 201

    @app.get("/users/<int:user_id>")
    def get_user(user_id: int) -> Any:
        user = db.get_or_404(User, user_id)
        return {"id": user.id, "email": user.email, "welcomed": user.welcomed}

    @app.cli.command("delayedq-worker")
    def run_worker() -> None:
        """Run the queue worker until SIGTERM or Ctrl-C."""
        make_worker(app).run()

    return app


def make_worker(app: Flask, **options: Any) -> Worker:
    """The worker process's worker, on the app's engine."""
    with app.app_context():
        engine = db.engine
    worker = Worker(sessionmaker(engine), **options)
    return worker.register(welcomes, send_welcome, mode="transactional")
