// A C++ program that runs an AOTInductor package as a deployment without Python would: it loads
// the op library (dlopen, which registers the tokamax ops), then the package, and runs it on the
// tensors of INPUTS (a torch.save'd list). It writes to OUTPUTS (torch::pickle_save) the list
// [results, inputs after the call, aliases], aliases[i] being the index of the input that
// result i shares its data with, or -1. Built and run by tests/test_aoti.py.
#include <dlfcn.h>

#include <fstream>
#include <iostream>
#include <iterator>
#include <vector>

#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/serialize.h>

namespace {

c10::impl::GenericList ListOf(const std::vector<at::Tensor>& tensors) {
  c10::impl::GenericList list(c10::AnyType::get());
  for (const at::Tensor& t : tensors) list.push_back(t);
  return list;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: runner LIBRARY PACKAGE INPUTS OUTPUTS\n";
    return 2;
  }
  if (dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    std::cerr << "dlopen " << argv[1] << ": " << dlerror() << "\n";
    return 1;
  }
  std::ifstream in(argv[3], std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::IValue loaded = torch::pickle_load(bytes);  // kept alive: the loop below reads into it
  std::vector<at::Tensor> inputs;
  for (const c10::IValue& value : loaded.toListRef()) inputs.push_back(value.toTensor());

  torch::inductor::AOTIModelPackageLoader loader(argv[2]);
  const std::vector<at::Tensor> results = loader.run(inputs);

  std::vector<int64_t> aliases;
  for (const at::Tensor& result : results) {
    int64_t alias = -1;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (result.data_ptr() == inputs[i].data_ptr()) alias = static_cast<int64_t>(i);
    }
    aliases.push_back(alias);
  }
  c10::impl::GenericList saved(c10::AnyType::get());
  saved.push_back(ListOf(results));
  saved.push_back(ListOf(inputs));
  saved.push_back(torch::tensor(aliases, torch::kInt64));
  const std::vector<char> out = torch::pickle_save(saved);
  std::ofstream(argv[4], std::ios::binary).write(out.data(), static_cast<std::streamsize>(out.size()));
  return 0;
}
