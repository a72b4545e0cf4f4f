class Model: pass
class ModelArgs: pass
