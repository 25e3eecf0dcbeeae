"""The Spaces login in a real browser: with `hf_oauth: true` (OAUTH_CLIENT_ID set), signing in
fills the Annotate tab's annotator with the Hugging Face user name; signed out, the field stays
empty for a typed name. Gradio's local mock of the OAuth routes stands in for hf.co, with its
`whoami` call (the one network access) replaced by a fixed profile."""
from __future__ import annotations


import pytest

from app.ui import build_demo, close_demo
from browser import launch

USER = "ada-lovelace"

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def mocked_oauth_info() -> dict:
    return {"access_token": "mock-oauth-token", "token_type": "bearer", "expires_in": 3600,
            "scope": "openid profile", "userinfo": {"sub": "1", "name": "Ada Lovelace", "preferred_username": USER,
                                                    "profile": f"https://huggingface.co/{USER}", "picture": ""}}


def test_the_spaces_login_names_the_annotator(tmp_path, monkeypatch) -> None:
    from gradio import oauth
    from playwright.sync_api import expect, sync_playwright

    monkeypatch.setenv("OAUTH_CLIENT_ID", "test-client")
    monkeypatch.setattr(oauth, "_get_mocked_oauth_info", mocked_oauth_info)
    demo = build_demo(db_path=str(tmp_path / "oauth.db"))
    _, url, _ = demo.launch(prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page()
            page.set_default_timeout(30_000)
            page.goto(url)
            page.get_by_role("tab", name="Annotate").click()
            annotator = page.get_by_label("Annotator")
            expect(page.get_by_role("button", name="Sign in with Hugging Face")).to_be_visible()
            expect(annotator).to_have_value("")  # signed out: the field waits for a typed name
            page.goto(url.rstrip("/") + "/login/huggingface")  # the mock signs in and redirects back
            page.get_by_role("tab", name="Annotate").click()
            expect(annotator).to_have_value(USER)
            browser.close()
    finally:
        close_demo(demo)
