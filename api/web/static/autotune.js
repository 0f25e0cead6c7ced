// autotune's one script: copy buttons, and an unfinished run's page that refreshes itself.
// Every page works without it; it never sees the token (an HttpOnly cookie).
"use strict";

function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    return navigator.clipboard.writeText(text);
  }
  // Plain http on a LAN address is not a secure context: the old way still copies there.
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.appendChild(area);
  area.select();
  const done = document.execCommand("copy");
  area.remove();
  return done ? Promise.resolve() : Promise.reject(new Error("copy refused"));
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("button.copy");
  if (!button) return;
  const source = document.getElementById(button.dataset.copy);
  const note = button.parentElement.querySelector(".copied");
  copyText(source.textContent).then(
    () => { note.textContent = "Copied"; },
    () => { note.textContent = "Copy failed: select the text and copy it"; },
  );
});

// A queued or running run: ask the cheap progress endpoint; when anything new was stored,
// fetch this page again and swap its content in (scroll position and focus stay).
function follow(main) {
  const url = main.dataset.progressUrl;
  const pollMs = Number(main.dataset.pollMs || 1000);
  let last = main.dataset.progressKey;
  async function tick() {
    let next = pollMs;
    try {
      const answer = await fetch(url, { credentials: "same-origin", cache: "no-store" });
      if (answer.ok) {
        const progress = await answer.json();
        const key = `${progress.status}/${progress.attempts}/${progress.trials}`;
        if (key !== last) {
          const page = await fetch(window.location.href, { credentials: "same-origin", cache: "no-store" });
          const fresh = new DOMParser().parseFromString(await page.text(), "text/html");
          const freshMain = fresh.getElementById("main");
          if (freshMain) {
            main.innerHTML = freshMain.innerHTML;
            main.dataset.status = freshMain.dataset.status;
            main.dataset.progressKey = freshMain.dataset.progressKey;
            if (!freshMain.dataset.progressUrl) return;  // finished: nothing more will come
          }
        }
        last = key;
      } else {
        next = pollMs * 5;  // the token was withdrawn or the run vanished: ask rarely
      }
    } catch (error) {
      next = pollMs * 5;  // the server is restarting or the network is down: keep trying
    }
    window.setTimeout(tick, next);
  }
  tick();
}

document.addEventListener("DOMContentLoaded", () => {
  const main = document.getElementById("main");
  if (main && main.dataset.progressUrl) follow(main);
});
