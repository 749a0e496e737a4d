// llmserve_client: generate text from an llmserve gateway over gRPC (llmserve/protos/api.proto).
//
// Streams the completion to stdout, each text delta as it arrives; the model's name, the finish
// reason and the usage counts go to stderr. With --cancel-after N it cancels the call once N
// deltas have arrived (the gateway aborts the request and its KV blocks are freed within a step)
// and exits 0 if the server saw the cancellation.
//
//   llmserve_client [--address HOST:PORT] [--max-tokens N] [--temperature T] [--ignore-eos]
//                   [--cancel-after N] [--request-id ID] PROMPT
//
// The API key, when the gateway wants one, comes from $LLMSERVE_API_KEY (sent as a Bearer
// token, as the Python client does).

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>

#include "llmserve/protos/api.grpc.pb.h"

namespace api = llmserve::api::v1;
namespace common = llmserve::common::v1;

namespace {

struct Options {
  std::string address = "localhost:50051";
  std::string prompt;
  std::string request_id;
  int max_tokens = 64;
  float temperature = 0.0f;  // greedy, so a run is reproducible
  bool ignore_eos = false;
  int cancel_after = 0;  // 0: never cancel
};

int Usage(const char* program) {
  std::cerr << "usage: " << program
            << " [--address HOST:PORT] [--max-tokens N] [--temperature T] [--ignore-eos]"
               " [--cancel-after N] [--request-id ID] PROMPT\n";
  return 2;
}

bool Parse(int argc, char** argv, Options* options) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::cerr << name << " needs a value\n";
        return nullptr;
      }
      return argv[++i];
    };
    const char* v = nullptr;
    if (arg == "--ignore-eos") {
      options->ignore_eos = true;
    } else if (arg == "--address") {
      if (!(v = value("--address"))) return false;
      options->address = v;
    } else if (arg == "--request-id") {
      if (!(v = value("--request-id"))) return false;
      options->request_id = v;
    } else if (arg == "--max-tokens") {
      if (!(v = value("--max-tokens"))) return false;
      options->max_tokens = std::atoi(v);
    } else if (arg == "--temperature") {
      if (!(v = value("--temperature"))) return false;
      options->temperature = std::strtof(v, nullptr);
    } else if (arg == "--cancel-after") {
      if (!(v = value("--cancel-after"))) return false;
      options->cancel_after = std::atoi(v);
    } else if (!arg.empty() && arg[0] == '-') {
      std::cerr << "unknown option " << arg << "\n";
      return false;
    } else {
      options->prompt = arg;
    }
  }
  return !options->prompt.empty();
}

void AddCredentials(grpc::ClientContext* context) {
  if (const char* key = std::getenv("LLMSERVE_API_KEY"); key && *key) {
    context->AddMetadata("authorization", std::string("Bearer ") + key);
  }
}

// The model the gateway serves (stderr); false when the gateway cannot be reached.
bool PrintModel(api::Generation::Stub* stub) {
  grpc::ClientContext context;
  AddCredentials(&context);
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  api::ModelInfo info;
  grpc::Status status = stub->GetModelInfo(&context, api::GetModelInfoRequest(), &info);
  if (!status.ok()) {
    std::cerr << "GetModelInfo failed: " << status.error_message() << "\n";
    return false;
  }
  std::cerr << "model=" << info.model() << " max_model_len=" << info.max_model_len() << "\n";
  return true;
}

int Generate(api::Generation::Stub* stub, const Options& options) {
  api::GenerateRequest request;
  request.set_text(options.prompt);
  request.set_max_tokens(options.max_tokens);
  request.set_ignore_eos(options.ignore_eos);
  request.set_request_id(options.request_id);
  request.mutable_sampling()->set_temperature(options.temperature);

  grpc::ClientContext context;
  AddCredentials(&context);
  std::unique_ptr<grpc::ClientReader<api::GenerateResponse>> reader(
      stub->Generate(&context, request));
  api::GenerateResponse response;
  int num_deltas = 0;
  bool cancelled = false;
  while (reader->Read(&response)) {
    std::cout << response.text() << std::flush;  // each delta as it arrives
    ++num_deltas;
    if (response.finish_reason() != common::FINISH_REASON_UNSPECIFIED) {
      const api::Usage& usage = response.usage();
      std::cerr << "\nrequest_id=" << response.request_id()
                << " finish_reason=" << common::FinishReason_Name(response.finish_reason())
                << " prompt_tokens=" << usage.prompt_tokens()
                << " completion_tokens=" << usage.completion_tokens()
                << " cached_prompt_tokens=" << usage.cached_prompt_tokens() << "\n";
    }
    if (options.cancel_after > 0 && num_deltas == options.cancel_after && !cancelled) {
      context.TryCancel();  // the gateway sees the call end and aborts the request
      cancelled = true;
    }
  }
  grpc::Status status = reader->Finish();
  if (cancelled) {
    std::cerr << "\ncancelled after " << num_deltas << " deltas: "
              << (status.error_code() == grpc::StatusCode::CANCELLED ? "CANCELLED" : "finished")
              << "\n";
    return status.error_code() == grpc::StatusCode::CANCELLED ? 0 : 1;
  }
  if (!status.ok()) {
    std::cerr << "\nGenerate failed: code " << status.error_code() << ": "
              << status.error_message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!Parse(argc, argv, &options)) return Usage(argv[0]);
  auto channel = grpc::CreateChannel(options.address, grpc::InsecureChannelCredentials());
  std::unique_ptr<api::Generation::Stub> stub = api::Generation::NewStub(channel);
  if (!PrintModel(stub.get())) return 1;
  return Generate(stub.get(), options);
}
