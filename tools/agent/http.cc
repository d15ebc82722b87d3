#include "http.h"

#include <httplib.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "agent.h"
#include "status.h"

using namespace std::string_literals;

namespace gpuslice::agent {

struct HttpServer::Impl {
  Agent& agent;
  httplib::Server server;
  std::thread thread;
  StatusHistory history;
  explicit Impl(Agent& a) : agent(a) {}
};

namespace {
std::uint64_t wall_ms() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}
}  // namespace

void HttpServer::sample_history() {
  if (!impl_->thread.joinable()) return;
  const std::uint64_t now = wall_ms();
  if (impl_->history.due(now)) impl_->history.record(now, impl_->agent.metrics_text());
}

bool parse_listen(const std::string& text, std::string* host, int* port, std::string* why) {
  std::string h, p;
  if (!text.empty() && text[0] == '[') {
    const auto close = text.find("]:");
    if (close == std::string::npos) {
      *why = "expected [address]:port";
      return false;
    }
    h = text.substr(1, close - 1);
    p = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) {
      *why = "expected host:port";
      return false;
    }
    h = text.substr(0, colon);
    p = text.substr(colon + 1);
  }
  if (h.empty()) h = "127.0.0.1";
  char* end = nullptr;
  const long v = p.empty() ? -1 : std::strtol(p.c_str(), &end, 10);
  if (p.empty() || *end != '\0' || v < 0 || v > 65535) {
    *why = "port '"s + p + "' is not 0-65535";
    return false;
  }
  *host = h;
  *port = static_cast<int>(v);
  return true;
}

HttpServer::HttpServer(Agent& agent) : impl_(std::make_unique<Impl>(agent)) {}

HttpServer::~HttpServer() { stop(); }

bool HttpServer::start(const std::string& host, int port, std::string* why) {
  httplib::Server& svr = impl_->server;
  // Two workers: scrapes are rare and serialised with the cycles anyway.
  svr.new_task_queue = [] { return new httplib::ThreadPool(2); };
  svr.set_read_timeout(5, 0);
  svr.set_write_timeout(5, 0);
  Agent& agent = impl_->agent;
  svr.Get("/metrics", [&agent](const httplib::Request&, httplib::Response& res) {
    res.set_content(agent.metrics_text(), "text/plain; version=0.0.4; charset=utf-8");
  });
  // The node status page and its data (status.h).
  StatusHistory& history = impl_->history;
  svr.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content(status_page_html(), "text/html; charset=utf-8");
  });
  svr.Get("/api/status", [&agent, &history](const httplib::Request&, httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_content(history.json(wall_ms(), agent.metrics_text()), "application/json");
  });
  svr.Get("/healthz", [&agent](const httplib::Request&, httplib::Response& res) {
    if (agent.healthy()) {
      res.set_content("ok\n", "text/plain");
    } else {
      res.status = 503;
      res.set_content("no cycle completed recently\n", "text/plain");
    }
  });
  int bound = port;
  if (port == 0) {
    bound = svr.bind_to_any_port(host);
  } else if (!svr.bind_to_port(host, port)) {
    bound = -1;
  }
  if (bound <= 0) {
    *why = "cannot listen on "s + host + ":" + std::to_string(port);
    return false;
  }
  port_ = bound;
  impl_->thread = std::thread([&svr] { svr.listen_after_bind(); });
  // stop() before the loop runs would be lost (and join() would hang): wait
  // until it is up (microseconds).
  for (int i = 0; i < 2000 && !svr.is_running(); ++i) std::this_thread::sleep_for(std::chrono::microseconds(500));
  return true;
}

void HttpServer::stop() {
  if (!impl_ || !impl_->thread.joinable()) return;
  impl_->server.stop();
  impl_->thread.join();
}

}  // namespace gpuslice::agent
