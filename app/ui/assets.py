"""CSS for the HTML views and the keyboard script of the Annotate tab."""
from __future__ import annotations

from app.ui import constants as C

# Scoped to each gr.HTML through `css_template` (Gradio 6 moved app-wide css to launch(),
# which the CLI and the Space call without it). Colours are translucent so that both the
# light and the dark theme read well.
VIEW_CSS = """
.ea-cards, .ea-state, .ea-compare { display: flex; flex-direction: column; gap: 8px; font-size: 13px; }
.ea-step-head { font-weight: 600; }
.ea-card { border: 1px solid rgba(128,128,128,.35); border-radius: 8px; padding: 8px 10px; }
.ea-committed { border: 2px solid #16a34a; background: rgba(22,163,74,.06); }
.ea-card-head { display: flex; flex-wrap: wrap; gap: 6px; align-items: baseline; margin-bottom: 6px; }
.ea-badge { font-size: 11px; padding: 1px 6px; border-radius: 10px; background: rgba(128,128,128,.2); }
.ea-badge-committed { background: #16a34a; color: white; font-weight: 600; }
.ea-badge-diverged { background: #dc2626; color: white; font-weight: 600; }
.ea-badge-matched { background: rgba(22,163,74,.18); }
.ea-metric { cursor: help; border-bottom: 1px dotted rgba(128,128,128,.6); }
.ea-action { font-size: 12px; word-break: break-all; }
.ea-scores, .ea-dim { opacity: .75; font-size: 12px; }
.ea-grid { display: grid; grid-template-columns: 1fr 1fr; gap: 8px; }
.ea-label { font-weight: 600; font-size: 12px; margin: 2px 0; }
.ea-pre, .ea-diff { margin: 0; padding: 6px; max-height: 260px; overflow: auto; white-space: pre-wrap;
  word-break: break-word; font-size: 12px; background: rgba(128,128,128,.08); border-radius: 6px; }
.ea-del { display: block; background: rgba(220,38,38,.18); }
.ea-add { display: block; background: rgba(22,163,74,.18); }
.ea-eq { display: block; opacity: .7; }
.ea-parse-error, .ea-error { color: #dc2626; font-weight: 600; }
.ea-metrics { font-size: 12px; margin-top: 4px; }
.ea-fork-diff { font-size: 12px; margin-top: 4px; }
.ea-memory { font-size: 12px; margin-top: 4px; }
.ea-table { border-collapse: collapse; width: 100%; font-size: 12px; table-layout: fixed; }
.ea-table td, .ea-table th { border: 1px solid rgba(128,128,128,.3); padding: 3px 6px; text-align: left; vertical-align: top; overflow-wrap: anywhere; }
.ea-table code { white-space: pre-wrap; overflow-wrap: anywhere; }
.ea-added { background: rgba(22,163,74,.1); }
.ea-removed { background: rgba(220,38,38,.1); }
.ea-first-diff { background: rgba(234,179,8,.25); font-weight: 600; }
.ea-empty { opacity: .7; padding: 8px; }
.ea-msg { padding: 6px 10px; border-radius: 6px; }
.ea-msg-error { background: rgba(220,38,38,.12); border: 1px solid #dc2626; }
.ea-msg-warning { background: rgba(217,119,6,.12); border: 1px solid #d97706; }
.ea-msg-info { background: rgba(59,130,246,.10); border: 1px solid rgba(59,130,246,.6); }
.ea-cheatsheet table td { padding: 2px 8px; }
/* Opened over the page, near its top right, where it is seen whatever the scroll (at the bottom of the tab it
   opened below the fold). */
.ea-cheatsheet { position: fixed; top: 96px; right: 24px; z-index: 1000; max-width: 460px; padding: 10px 14px;
  background: var(--background-fill-primary, #fff); border: 1px solid rgba(128,128,128,.5); border-radius: 8px;
  box-shadow: 0 6px 24px rgba(0,0,0,.18); font-size: 13px; }
"""

CHEATSHEET = f"""<div class="ea-cheatsheet" style="display:none"><b>Keyboard (Annotate tab)</b>
<table>
<tr><td><kbd>←</kbd> / <kbd>→</kbd></td><td>previous / next branch</td></tr>
<tr><td><kbd>1</kbd>…<kbd>5</kbd></td><td>label: {' · '.join(f'{i + 1} {label}' for i, label in enumerate(C.LABELS))}</td></tr>
<tr><td><kbd>Ctrl</kbd>+<kbd>Enter</kbd></td><td>save and go to the next branch (also inside a text field)</td></tr>
<tr><td><kbd>?</kbd></td><td>show or hide this sheet (or the <b>? Keyboard</b> button)</td></tr>
</table></div>"""

# Installed once per page by demo.load(js=...). Keys act only while the Annotate tab is
# visible; arrows and digits are left alone while typing in a field.
KEYBOARD_JS = f"""
() => {{
  if (window.__envaceKeys) return [];
  window.__envaceKeys = true;
  const byId = (id) => document.getElementById(id);
  const shown = (id) => {{ const el = byId(id); return !!el && el.offsetParent !== null; }};
  const press = (id) => {{
    const el = byId(id); if (!el) return;
    (el.tagName === 'BUTTON' ? el : el.querySelector('button'))?.click();
  }};
  const toggleSheet = () => {{
    const sheet = byId('{C.ID_ANN_CHEATSHEET}')?.querySelector('.ea-cheatsheet');
    if (sheet) sheet.style.display = sheet.style.display === 'none' ? 'block' : 'none';
  }};
  window.__envaceToggleSheet = toggleSheet;
  document.addEventListener('keydown', (e) => {{
    if (!shown('{C.ID_ANN_PANEL}')) return;
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {{ e.preventDefault(); press('{C.ID_ANN_SAVE}'); return; }}
    const t = e.target;
    if (t && (t.tagName === 'TEXTAREA' || t.tagName === 'INPUT' && t.type !== 'radio' || t.isContentEditable)) return;
    if (e.key === 'ArrowRight') {{ e.preventDefault(); press('{C.ID_ANN_NEXT}'); }}
    else if (e.key === 'ArrowLeft') {{ e.preventDefault(); press('{C.ID_ANN_PREV}'); }}
    else if (/^[1-5]$/.test(e.key)) {{
      const radios = byId('{C.ID_ANN_LABEL}')?.querySelectorAll('input[type=radio]') || [];
      const r = radios[Number(e.key) - 1]; if (r) {{ r.click(); e.preventDefault(); }}
    }}
    else if (e.key === '?') {{ e.preventDefault(); toggleSheet(); }}
  }});
  return [];
}}
"""

# Dropdowns cut long values (task ids with their first message, adapter paths) to the column's
# width: hovering one shows the whole value as the browser's own tooltip.
HOVER_JS = f"""
() => {{
  if (window.__envaceHover) return [];
  window.__envaceHover = true;
  document.addEventListener('mouseover', (e) => {{
    const input = e.target.closest?.('.{C.CLASS_FULL_ON_HOVER} input');
    if (input) input.title = input.value;
  }});
  return [];
}}
"""
