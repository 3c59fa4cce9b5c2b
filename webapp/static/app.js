// Chat page: plain JavaScript, no build step. Streams /v1/chat/completions token by token.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];  // [{role, content}] of the conversation so far
let controller = null;  // AbortController of the running request

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;  // never innerHTML: model output is untrusted
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function readEvents(response, onChunk) {
  // Parses an SSE body: "data: {json}\n\n" ... "data: [DONE]\n\n".
  const reader = response.body.getReader();
  const decoder = new TextDecoder("utf-8");
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const out = addMessage("assistant", "");
  out.dataset.state = "streaming";
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) headers["Authorization"] = "Bearer " + key;
  const system = $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(history);
  const body = {
    messages: messages,
    stream: true,
    max_tokens: parseInt($("max-tokens").value, 10) || 512,
    temperature: parseFloat($("temperature").value),
  };
  controller = new AbortController();
  setBusy(true);
  let reply = "";
  let numChunks = 0;
  let reasoning = "";  // a reasoning model's delta.reasoning_content, shown above the reply
  let thinking = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers, body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      let message = response.status + " " + response.statusText;
      try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);  // failure after the stream began
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const thought = (choice.delta && choice.delta.reasoning_content) || "";
      if (thought) {
        if (!thinking) {
          thinking = document.createElement("div");
          thinking.className = "msg reasoning";
          $("log").insertBefore(thinking, out);
        }
        reasoning += thought;
        thinking.textContent = reasoning;  // never innerHTML
        $("log").scrollTop = $("log").scrollHeight;
      }
      const piece = (choice.delta && choice.delta.content) || "";
      if (piece) {
        reply += piece;
        out.textContent = reply;
        numChunks += 1;
        out.dataset.chunks = String(numChunks);
        $("log").scrollTop = $("log").scrollHeight;
      }
      if (choice.finish_reason) out.dataset.finish = choice.finish_reason;
    });
    out.dataset.state = "done";
  } catch (err) {
    if (err.name === "AbortError") {
      out.dataset.state = "stopped";
    } else {
      out.dataset.state = "error";
      out.classList.add("error");
      out.textContent = reply + (reply ? "\n" : "") + "Error: " + err.message;
    }
  } finally {
    if (reply) history.push({ role: "assistant", content: reply });
    controller = null;
    setBusy(false);
    $("input").focus();
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => { history.length = 0; $("log").textContent = ""; });

fetch("/v1/models", { headers: $("api-key").value ? { Authorization: "Bearer " + $("api-key").value } : {} })
  .then((r) => (r.ok ? r.json() : null))
  .then((data) => { if (data && data.data && data.data[0]) $("model").textContent = data.data[0].id; })
  .catch(() => {});
