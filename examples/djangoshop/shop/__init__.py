"""The example's app: organizations, their projects and invitations, and a search index that
outbox handlers keep up to date."""
