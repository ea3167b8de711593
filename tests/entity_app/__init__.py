"""A tiny host application for entity-queue tests: orders, before and after the mixin."""
