// The agent's HTTP endpoint (cpp-httplib): GET /metrics (Prometheus text
// format), GET /healthz, and the node status page: GET / (HTML) with its data
// at GET /api/status (status.h). Loopback only unless --listen says otherwise.
#pragma once

#include <memory>
#include <string>

namespace gpuslice::agent {

class Agent;

// "host:port", "[v6addr]:port" or ":port" (loopback). Port 0 = any free port.
bool parse_listen(const std::string& text, std::string* host, int* port, std::string* why);

class HttpServer {
 public:
  explicit HttpServer(Agent& agent);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts serving on a thread of its own; false + why on failure.
  bool start(const std::string& host, int port, std::string* why);
  int port() const { return port_; }
  // Records the status page's history (at most every 2 s): called after each cycle.
  void sample_history();
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace gpuslice::agent
